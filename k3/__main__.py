from k3.cli.main import main

if __name__ == "__main__":  # not when a spawned engine process imports it
    raise SystemExit(main())
