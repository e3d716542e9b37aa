"""What a gelastic command shows of the job it ran, and where: the terminal and the scheduler.

Worker text (tracebacks, stderr tails) is whatever the job's programs wrote: on a terminal it is
shown without its escape sequences (`strip_terminal_controls`). A FAILED job's root cause goes
to the error file of the scheduler that started the command, in torch's format
(`write_scheduler_error_file`). The client's own commands take both from the private modules
that own them; `gelastic run`, a layer up in the `gelastic` package, takes them from here.
"""

from __future__ import annotations

from client._scheduler_error import write_scheduler_error_file
from client._terminal import strip_terminal_controls

__all__ = ["strip_terminal_controls", "write_scheduler_error_file"]
