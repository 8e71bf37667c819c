"""The serving evaluation behind ``mooncake eval``: a FAST'25 trace driven at its timestamps
against real vLLM instances (one instance; two sharing the store; prefill/decode over the
engine), per-request records, a Markdown report, plots and the simulator's prediction beside.

Pure parts (importable without vLLM, torch or matplotlib): :mod:`.workload` (trace selection,
scaling, prompts), :mod:`.records` (the per-request record and the statistics), :mod:`.report`
(JSON and Markdown). The parts that start processes (:mod:`.cluster`, :mod:`.client`,
:mod:`.run`) need only ``httpx``; vLLM runs in child processes of the python given by
``--vllm-python``; :mod:`.weights` runs there too (torch, safetensors); :mod:`.plots` imports
matplotlib lazily.
"""
