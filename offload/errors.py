"""The one error type for input a command refuses (a bad path, file, flag or setting value). Raised before any
work starts where it can be; its message names the flag or path and the fix. The CLI (offload/cli.py) prints it
as one line and exits 2, without a traceback (OFFLOAD_DEBUG=1 shows it)."""


class InputError(ValueError):
    pass
