"""Attention distillation in a Hugging Face ``transformers.Trainer``: override ``compute_loss``.

    python examples/hf_trainer.py
"""

from __future__ import annotations

import tempfile

import torch
from lightning_tiny import TokenDataModule, llama_config, tiny_teacher
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

from lightning_streamkl import AttentionDistiller


class DistillingTrainer(Trainer):
    def __init__(self, *args, teacher, distillation, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.distiller = AttentionDistiller(teacher, distillation, student=self.model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self.distiller.distilling(inputs, step=self.state.global_step) as kd:
            outputs = model(**inputs)
        if model.training:
            self.log({"attn_kl": float(kd.terms.total.detach())})
        loss = outputs.loss + kd.loss  # the task loss plus weight · attention KL
        return (loss, outputs) if return_outputs else loss


def main(max_steps: int = 60, output_dir: str | None = None) -> dict[str, float]:
    torch.manual_seed(1)
    teacher = tiny_teacher()
    student = LlamaForCausalLM(llama_config(hidden_size=16, num_kv_heads=1))
    rows = [dict(zip(("input_ids", "attention_mask", "labels"), row))
            for batch in TokenDataModule().train_dataloader() for row in zip(*batch.values())]
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=output_dir or scratch, max_steps=max_steps, per_device_train_batch_size=8,
                                 learning_rate=0.01, logging_steps=max(1, max_steps // 4), report_to=[],
                                 save_strategy="no", use_cpu=True, disable_tqdm=True, seed=1)
        trainer = DistillingTrainer(model=student, args=args, train_dataset=rows, teacher=teacher,
                                    distillation={"pairs": [[-1, -1]], "weight": 5.0})
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "attn_kl" in entry]
    steps = trainer.state.global_step
    return {"attn_kl_first": logs[0]["attn_kl"], "attn_kl_last": logs[-1]["attn_kl"], "steps": steps}


if __name__ == "__main__":
    print(main())
