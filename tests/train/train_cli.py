"""The `k3 train` command line the training tests share."""


def cli_args(out, *extra):
    """`k3 train` on the tiny preset for 4 steps of 2 x 32 tokens into ``out``, then ``extra``."""
    return [
        "train",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--vocab-size",
        "300",
        "--max-tokens",
        "20000",
        "--eval-every",
        "2",
        "--eval-rows",
        "2",
        "--samples",
        "1",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]
