"""A tiny random GPT-2 and its data, built from a config on CPU (nothing downloaded), for the Trainer tests.

Import it after ``pytest.importorskip("transformers")``: it needs torch and transformers.
"""

from __future__ import annotations

import torch
import transformers


class TinyLM(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)
