"""The ``streamkl-distill`` job: teacher, students with and without attention KL, evaluation and report."""

from .distill import DistillationJob, JobConfig, RunStats, naive_loss_bytes
from .report import outcome, render_report, write_outputs

__all__ = ["DistillationJob", "JobConfig", "RunStats", "naive_loss_bytes", "outcome", "render_report",
           "write_outputs"]
