"""Lightning integration of StreamKL attention distillation (callback, mixin, metrics, configs)."""

__all__: list[str] = []
