"""Attention KL in TRL's ``SFTTrainer``, with padding-free packing: the trainer class plus ``AttentionKLMixin``.

    python examples/trl_sft.py
"""

from __future__ import annotations

import tempfile

import torch
from datasets import Dataset
from lightning_tiny import llama_config, rule_texts, tiny_teacher, tiny_tokenizer
from transformers import LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

from lightning_streamkl.integrations.trl import AttentionKLMixin


class SFTWithAttentionKL(AttentionKLMixin, SFTTrainer):
    """SFTTrainer whose loss is its own plus weight · attention KL to a teacher."""


def main(max_steps: int = 40, padding_free: bool = True, output_dir: str | None = None) -> dict[str, float]:
    torch.manual_seed(1)
    teacher = tiny_teacher()  # in real use: AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16)
    student = LlamaForCausalLM(llama_config(hidden_size=16, num_kv_heads=1))
    dataset = Dataset.from_dict({"text": rule_texts(64)})
    distillation = {"pairs": [{"teacher": -1, "student": -1, "name": "last"}], "weight": 5.0}
    with tempfile.TemporaryDirectory() as scratch:
        args = SFTConfig(output_dir=output_dir or scratch, max_steps=max_steps, per_device_train_batch_size=8,
                         padding_free=padding_free, max_length=None, learning_rate=0.01,
                         logging_steps=max(1, max_steps // 4), use_cpu=True, bf16=False,  # (CPU; drop on a GPU)
                         report_to=[], save_strategy="no", disable_tqdm=True, seed=1)
        trainer = SFTWithAttentionKL(model=student, args=args, train_dataset=dataset, processing_class=tiny_tokenizer(),
                                     attention_teacher=teacher, attention_kl=distillation)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "attn_kl/total" in entry]  # beside loss, entropy, ...
    return {"attn_kl_first": logs[0]["attn_kl/total"], "attn_kl_last": logs[-1]["attn_kl/total"],
            "loss_last": logs[-1]["loss"], "steps": trainer.state.global_step}


if __name__ == "__main__":
    print(main())
