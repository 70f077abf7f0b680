"""The long-context experiment's configurations: ``GPU`` (one H100) and ``SMOKE``
(every step at toy sizes, for the CPU test). ``run.py`` runs them; ``tables.py`` renders the setup table from them."""

from __future__ import annotations

from typing import Any

#: The GPU experiment (one H100): the choices are explained in docs/guides/long-context.md and backed by the CPU
#: checks of cpu_check.py (benchmarks/results/long_context_cpu/).
GPU: dict[str, Any] = {
    "task": {"num_keys": 64, "num_values": 64, "num_noise": 32, "num_pairs": 8, "query_every": 16},
    "teacher": {"d_model": 128, "num_layers": 2, "num_heads": 4, "conv_kernel": 4},
    "student": {"d_model": 64, "num_layers": 2, "num_heads": 4, "conv_kernel": 4},
    # short sequences first (the plateau is short there and NoPE carries the lookup to any length), then a mix up to
    # the students' length; more steps of the last stage while the teacher is below `target` at `check_len`
    "teacher_train": {"stages": [[2000, [[256, 64]]], [600, [[1024, 16], [4096, 4], [16384, 1]]]], "lr": 3e-3,
                      "warmup": 50, "target": 0.99, "check_len": 16384, "check_sequences": 4, "extend_steps": 300,
                      "max_extensions": 20, "time_limit_s": 240, "data_seed": 10_000},
    "student_train": {"seq_len": 16384, "batch": 4, "steps": 2000, "lr": 3e-3, "warmup": 50, "max_time_factor": 6},
    # the distilled student's KL covers the task's query rows; "extra_arms" (run after every seed's main pair, as the
    # budget allows, step-matched only) adds the library's default, every row
    "kl": {"pairs": [[0, 0], [1, 1]], "weight": 1.0, "rows": "queries", "extra_arms": {"kl_all": "all"}},
    "seeds": [0, 1, 2],
    "eval": {"lengths": [4096, 8192, 16384, 32768], "sequences": 16, "tokens_per_batch": 65536, "depth_bins": 4},
    "attn_kl_eval": {"seq_len": 16384, "sequences": 2},
    "cost": {"steps": 20, "warmup": 5, "configs": [
        {"name": "experiment", "seq_len": 16384, "batch": 4, "variants": ["queries", "all", "all-no-early-exit"]},
        {"name": "wide (d=256, head dim 64, MLP)", "seq_len": 16384, "batch": 4, "variants": ["all", "queries"],
         "student": {"d_model": 256, "num_layers": 2, "num_heads": 4, "mlp_ratio": 4},
         "teacher": {"d_model": 512, "num_layers": 2, "num_heads": 4, "mlp_ratio": 4}},
        {"name": "LM-like (d=1024, 16 heads of 64, 4 layers, MLP)", "seq_len": 16384, "batch": 1,
         "variants": ["all"], "pairs": [[1, 1], [2, 2]],
         "student": {"d_model": 1024, "num_layers": 4, "num_heads": 16, "mlp_ratio": 4},
         "teacher": {"d_model": 2048, "num_layers": 4, "num_heads": 16, "mlp_ratio": 4}},
    ]},
}

#: Every step of the GPU experiment at toy sizes (a CPU test runs it).
SMOKE: dict[str, Any] = {
    "task": {"num_keys": 8, "num_values": 8, "num_noise": 4, "num_pairs": 2, "query_every": 8},
    "teacher": {"d_model": 16, "num_layers": 2, "num_heads": 2, "conv_kernel": 3},
    "student": {"d_model": 8, "num_layers": 2, "num_heads": 2, "conv_kernel": 3},
    "teacher_train": {"stages": [[3, [[32, 4]]], [2, [[32, 2], [64, 1]]]], "lr": 3e-3, "warmup": 2, "target": 0.99,
                      "check_len": 64, "check_sequences": 2, "extend_steps": 2, "max_extensions": 1, "time_limit_s": 30,
                      "data_seed": 10_000},
    "student_train": {"seq_len": 64, "batch": 2, "steps": 4, "lr": 3e-3, "warmup": 2, "max_time_factor": 6},
    "kl": {"pairs": [[0, 0], [1, 1]], "weight": 1.0, "rows": "queries", "extra_arms": {"kl_all": "all"}},
    "seeds": [0, 1, 2],
    "eval": {"lengths": [32, 64, 128], "sequences": 2, "tokens_per_batch": 256, "depth_bins": 2},
    "attn_kl_eval": {"seq_len": 64, "sequences": 2},
    "cost": {"steps": 2, "warmup": 1, "configs": [
        {"name": "experiment", "seq_len": 64, "batch": 2, "variants": ["queries", "all", "all-no-early-exit"]},
        {"name": "wide", "seq_len": 32, "batch": 1, "variants": ["all"], "pairs": [[0, 0], [1, 1]],
         "student": {"d_model": 16, "num_layers": 2, "num_heads": 2, "mlp_ratio": 2},
         "teacher": {"d_model": 32, "num_layers": 3, "num_heads": 2, "mlp_ratio": 2}},
    ]},
}
