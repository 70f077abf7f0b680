"""Attention KL in TRL's logit-distillation trainers, whose teacher pass the engine records (one teacher pass per
step): ``GKDTrainer`` (``trl.experimental.gkd``) and ``DistillationTrainer``, each plus ``AttentionKLMixin``.

    python examples/trl_gkd.py                  # GKDTrainer
    python examples/trl_gkd.py distillation     # DistillationTrainer
"""

from __future__ import annotations

import sys
import tempfile

import torch
from datasets import Dataset
from lightning_tiny import llama_config, rule_texts, tiny_teacher, tiny_tokenizer
from transformers import LlamaForCausalLM
from trl import DistillationConfig, DistillationTrainer
from trl.experimental.gkd import GKDConfig, GKDTrainer

from lightning_streamkl.integrations.trl import AttentionKLMixin


class GKDWithAttentionKL(AttentionKLMixin, GKDTrainer):
    """GKDTrainer whose loss is its generalised JSD plus weight · attention KL to its own teacher."""


class DistillationWithAttentionKL(AttentionKLMixin, DistillationTrainer):
    """DistillationTrainer whose loss is its generalised JSD plus weight · attention KL to its own teacher."""


#: The settings both trainers share here (CPU, tiny models: drop use_cpu and bf16 on a GPU).
COMMON = dict(per_device_train_batch_size=8, learning_rate=0.01, use_cpu=True, bf16=False, report_to=[],
              save_strategy="no", disable_tqdm=True, seed=1)


def halves(count: int = 64) -> list[tuple[str, str]]:
    """The task as (prompt, answer): the first half of each sequence, and the rest."""
    return [(" ".join(w[: len(w) // 2]), " ".join(w[len(w) // 2:])) for w in (t.split() for t in rule_texts(count))]


def main(trainer: str = "gkd", max_steps: int = 30, output_dir: str | None = None) -> dict[str, float]:
    torch.manual_seed(1)
    teacher = tiny_teacher()  # in real use: AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16)
    student = LlamaForCausalLM(llama_config(hidden_size=16, num_kv_heads=1))
    distillation = {"pairs": [{"teacher": -1, "student": -1, "name": "last"}], "weight": 5.0}
    logging = dict(max_steps=max_steps, logging_steps=max(1, max_steps // 3), **COMMON)
    with tempfile.TemporaryDirectory() as scratch:
        if trainer == "gkd":
            args = GKDConfig(output_dir=output_dir or scratch, lmbda=0.5, max_new_tokens=8, **logging)
            chats = Dataset.from_dict({"messages": [[{"role": "user", "content": p},
                                                     {"role": "assistant", "content": a}] for p, a in halves()]})
            run = GKDWithAttentionKL(model=student, teacher_model=teacher, args=args, train_dataset=chats,
                                     processing_class=tiny_tokenizer(), attention_kl=distillation)
        else:  # on-policy: the student answers the prompts itself
            prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p, _ in halves()]})
            args = DistillationConfig(output_dir=output_dir or scratch, max_completion_length=8, **logging)
            run = DistillationWithAttentionKL(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                                              processing_class=tiny_tokenizer("left"), attention_kl=distillation)
        run.train()
    logs = [entry for entry in run.state.log_history if "attn_kl/total" in entry]  # beside the trainer's loss
    return {"attn_kl_first": logs[0]["attn_kl/total"], "attn_kl_last": logs[-1]["attn_kl/total"],
            "steps": run.state.global_step}


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
