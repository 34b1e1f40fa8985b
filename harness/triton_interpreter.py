"""Loaded by train_gpt.py under TRITON_INTERPRET=1 (tests run the Triton kernels on CPU tensors),
before any kernel runs."""


def _squeeze_interpreted_scalars() -> None:
    """Triton 3.6's interpreter hands a scalar kernel argument over as a one-element array and
    makes a loop bound of it with int(array), which numpy 2.4+ refuses ("only 0-dimensional
    arrays can be converted to Python scalars"); Triton 3.9 squeezes the array first. Do the
    same, so that the kernels' CPU tests also run on images with torch 2.11 and Triton 3.6.
    Done at import, before any kernel runs: dynamo would trace it inside compiled code."""
    from triton.runtime import interpreter
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    # Another interpreter layout: leave it as it is. Patched already: a second copy of train_gpt.py
    # (as __main__ and as an imported module) loaded this again.
    if patch_tensor is None or getattr(patch_tensor, "squeezes_scalars", False):
        return

    def patch_tensor_squeezing(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    patch_tensor_squeezing.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_tensor_squeezing


_squeeze_interpreted_scalars()
