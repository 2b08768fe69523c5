"""Data parallelism: whole engine replicas in other processes (or Ray actors) behind
one front end that routes each request to the replica most likely to hold its prefix.

`DataParallelLLM` has AsyncLLM's surface, so the server does not know which it runs.
"""

from sluice.distributed.dp_llm import DataParallelLLM

__all__ = ["DataParallelLLM"]
