"""The ``comera`` command that ``pip install`` puts on the PATH: the same command line as
``cargo run --release --``, run by the extension module in this process."""

import sys

from . import _comera


def main() -> int:
    return int(_comera.cli_main(sys.argv))


if __name__ == "__main__":
    sys.exit(main())
