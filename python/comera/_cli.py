"""The ``comera`` command that ``pip install`` puts on the PATH: the same command line as
``cargo run --release --``, run by the extension module in this process."""

import signal
import sys

from . import _comera


def main() -> int:
    # Signals as the binary gets them: Ctrl-C ends a command at once, except where the command
    # handles it itself (`train` stops after its step with a checkpoint). Python's own handler
    # would raise a KeyboardInterrupt once the command has returned.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return int(_comera.cli_main(sys.argv))


if __name__ == "__main__":
    sys.exit(main())
