"""Attention distillation from a LightningCLI YAML file: the callback is configured in the trainer section.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml

``DistillationCLI`` is ``LightningCLI`` (same arguments) whose StreamKL config errors are the library's own messages.
"""

from __future__ import annotations

from lightning_tiny import CausalLMModule, TokenDataModule

from lightning_streamkl.cli import DistillationCLI


def main(args: list[str] | None = None) -> DistillationCLI:
    return DistillationCLI(CausalLMModule, TokenDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
