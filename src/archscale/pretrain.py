"""`python -m archscale.pretrain ...` (what torchrun launches): the same as `archscale pretrain ...`."""

import sys

from archscale.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
