"""Attention distillation from a LightningCLI YAML file: the callback is configured in the trainer section.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lightning_tiny import CausalLMModule, TokenDataModule


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(CausalLMModule, TokenDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
