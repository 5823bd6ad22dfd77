"""Static checks for the classic DDP / CUDA-graph / object-collective bugs (``ddpgraph lint``).

The script is parsed, never imported or run. Each rule has a code (``DG1xx``) and a message that
names what was seen and a fix. A rule reports only what it can prove for the file's entry points;
what it suspects but cannot prove (a count read from the command line, a list built elsewhere, a
library function whose caller is not in the file) is silent, and shown as a note with
``strict=True`` (``ddpgraph lint --strict``).

One module per rule family: ``device`` (DG101), ``object_lists`` (DG102), ``capture_stream``
(DG103), ``warmup`` (DG104), ``capture_body`` (DG105, DG106), ``replay`` (DG107, DG108),
``window_lr`` (DG109), ``kept_outputs`` (DG110); the shared AST helper is ``astutil``. A finding
is silenced by ``# noqa`` or ``# noqa: DG104`` on its line.
"""

from __future__ import annotations

from .core import RULES, Finding, LintError, Rule
from .runner import lint_file, lint_paths, lint_source

__all__ = ["RULES", "Finding", "LintError", "Rule", "lint_file", "lint_paths", "lint_source"]
