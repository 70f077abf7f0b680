"""The ``streamkl-distill`` demo job: a teacher, students with and without attention KL, evaluation and report.

Not part of the library API: :mod:`lightning_streamkl` never imports this package (a test checks it), and this
package uses only the library's public names and Lightning's public API, as any user code would. Its modules:
:mod:`.distill` (the job), :mod:`.report` (its outputs), :mod:`.recall` (the synthetic task and model),
:mod:`.cli` (the ``streamkl-distill`` LightningCLI; needs the ``cli`` extra) and the built-in ``configs/``.
"""

from .distill import DistillationJob, JobConfig, RunStats, UntilTarget, naive_loss_bytes
from .recall import RecallData, RecallModel, TinyTransformer, make_recall_batch
from .report import headline_table, outcome, render_report, write_outputs

__all__ = ["DistillationJob", "JobConfig", "RecallData", "RecallModel", "RunStats", "TinyTransformer", "UntilTarget",
           "headline_table", "make_recall_batch", "naive_loss_bytes", "outcome", "render_report", "write_outputs"]
