"""Seed-compatible entry point: `torchrun ... pretrain.py --train_model ... --depth ...`."""

import sys

from archscale.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
