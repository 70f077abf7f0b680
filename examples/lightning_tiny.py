"""Tiny stand-ins used by the examples: a synthetic token task and a LightningModule around a Hugging Face causal LM
built from a config, and, for the TRL examples, a word-level tokenizer and the same task as text (no downloads; a few
seconds on a CPU).

In real use the teacher is a trained model (``AutoModelForCausalLM.from_pretrained(...)``) and the student your
own LightningModule; nothing in the distillation code depends on these classes.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


def llama_config(hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                 init: float = 0.02) -> LlamaConfig:
    """A small Llama config (RoPE, GQA, causal); sdpa attention."""
    return LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads, intermediate_size=2 * hidden_size, vocab_size=VOCAB,
                       max_position_embeddings=128, initializer_range=init, pad_token_id=0,
                       attn_implementation="sdpa")


def tiny_teacher(seed: int = 0) -> LlamaForCausalLM:
    """A random Llama whose large initial weights give it peaked attention, standing in for a trained teacher."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, init=0.3))


class CausalLMModule(L.LightningModule):
    """The student: an ordinary LightningModule that trains a causal LM on its task loss."""

    def __init__(self, hidden_size: int = 16, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 1,
                 lr: float = 0.01, seed: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters("hidden_size", "num_layers", "num_heads", "num_kv_heads", "lr", "seed")
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(llama_config(hidden_size, num_layers, num_heads, num_kv_heads))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train/task_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/task_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class TokenDataModule(L.LightningDataModule):
    """Sequences following a fixed rule (next = (7·t + 3) mod V), right-padded at random lengths."""

    def __init__(self, num_sequences: int = 64, length: int = 24, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tokens = [torch.randint(1, VOCAB, (num_sequences, 1), generator=g)]
        for _ in range(length - 1):
            tokens.append((tokens[-1] * 7 + 3) % (VOCAB - 1) + 1)
        ids = torch.cat(tokens, 1)
        lengths = torch.randint(length // 2, length + 1, (num_sequences, 1), generator=g)
        mask = (torch.arange(length) < lengths).long()
        self.ids, self.mask = ids.masked_fill(mask == 0, 0), mask
        self.batch_size = batch_size

    def _loader(self, part: slice) -> DataLoader:
        ids, mask = self.ids[part], self.mask[part]
        return DataLoader(TensorDataset(ids, mask, ids.masked_fill(mask == 0, -100)), batch_size=self.batch_size,
                          collate_fn=_as_dict)

    def train_dataloader(self) -> DataLoader:
        return self._loader(slice(0, -self.batch_size))

    def val_dataloader(self) -> DataLoader:
        return self._loader(slice(-self.batch_size, None))


def tiny_tokenizer(padding_side: str = "right"):
    """A word-level tokenizer for the task as text: ``<pad>`` (0), ``<eos>`` (1) and the words ``t2`` ... ``t63``, with
    a chat template that joins the messages' contents (built in memory; no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        padding_side=padding_side)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if not add_generation_prompt %}<eos>{% endif %}")
    return tokenizer


def rule_texts(count: int = 64, length: int = 24, seed: int = 0) -> list[str]:
    """Sequences of the words of :func:`tiny_tokenizer` following a fixed rule (next = (7·t + 3) mod 62 + 2), of
    random lengths from ``length // 2`` to ``length``."""
    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(count):
        n = int(torch.randint(length // 2, length + 1, (1,), generator=g))
        token, words = int(torch.randint(2, VOCAB, (1,), generator=g)), []
        for _ in range(n):
            words.append(f"t{token}")
            token = (7 * token + 3) % (VOCAB - 2) + 2
        texts.append(" ".join(words))
    return texts


def take(loader, steps: int):
    """``steps`` batches, going through ``loader`` again as often as needed (for the loops without a Trainer)."""
    done = 0
    while done < steps:
        for batch in loader:
            yield batch
            done += 1
            if done == steps:
                return


def _as_dict(rows):
    ids, mask, labels = (torch.stack(x) for x in zip(*rows))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
