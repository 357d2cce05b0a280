"""The one error type for input a fine-tune cannot start with (a bad path, file or flag). Raised before
training starts; its message names the flag or path and the fix. `offload finetune` prints it without a
traceback and exits 2."""


class InputError(ValueError):
    pass
