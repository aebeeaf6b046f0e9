from k3.cli.main import main

raise SystemExit(main())
