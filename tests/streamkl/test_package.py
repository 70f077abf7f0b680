"""Packaging: the op package stands alone."""

import subprocess
import sys


def test_import_streamkl_does_not_import_lightning_or_triton():
    code = ("import sys, streamkl; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'lightning_streamkl', 'triton') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_surface():
    import streamkl

    assert set(streamkl.__all__) == {"AttentionKLLoss", "AttentionKLOptions", "KLWithCount", "attention_kl",
                                     "chunked_attention_kl", "naive_attention_kl", "indexer_kl", "naive_indexer_kl"}
