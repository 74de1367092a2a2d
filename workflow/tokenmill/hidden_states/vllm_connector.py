"""vLLM's ExampleHiddenStatesConnector, made to work on CPU: loaded INSIDE the vLLM server
(`"kv_connector": "CPUSafeHiddenStatesConnector", "kv_connector_module_path":
"tokenmill.hidden_states.vllm_connector"`), so it imports vLLM and torch only.

On CPU the stock connector crashes the engine after the first request: its async write
allocates `torch.empty_like(..., pin_memory=True)`, and CPU builds have no pinned-memory
allocator. This subclass overrides only that write when the KV cache is on the CPU (a plain CPU
tensor, then the same thread-pool file write under the same lock); on GPUs it is the stock one.
"""

from __future__ import annotations

import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands for the CUDA event of a device-to-host copy that, on CPU, is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"two hidden-states writes for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl

            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        return None
