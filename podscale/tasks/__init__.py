"""Tasks: one per model family (see :mod:`podscale.tasks.base` for the interface).

``gpt`` (:mod:`podscale.tasks.gpt`) is built in; a task of one's own is ``[model] kind = "custom"`` with
``task = "package.module:Class"``.
"""
from podscale.tasks.base import DataSource, LossFn, NoOptions, Task, check_task_layout, import_task, task_for

__all__ = ["Task", "DataSource", "LossFn", "NoOptions", "task_for", "import_task", "check_task_layout"]
