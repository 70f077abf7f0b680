"""The float32 matmul-precision setting as ``torch.compile`` reads it: once, when a graph is traced (dynamo cannot
trace the string ``torch.get_float32_matmul_precision()`` returns). Imported only while compiling: the decorator
imports ``torch._dynamo``, which importing ``streamkl`` must not (it pulls in triton)."""

import torch


@torch.compiler.assume_constant_result
def torch_allows_tf32() -> bool:
    """``torch.get_float32_matmul_precision() != "highest"``, a constant of the traced graph (the setting is
    process-wide; a graph compiled before it changes keeps the value it was traced with)."""
    return torch.get_float32_matmul_precision() != "highest"
