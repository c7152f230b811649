# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A host-memory tier for blocks the device prefix cache evicts.

``HostTierConnector`` (``vllm.distributed.kv_transfer.kv_connector.v1``)
hands each connector call to ``scheduler.HostTierScheduler`` (every decision)
or ``worker.HostTierWorker`` (the copies). ``host_index``, ``copy_engine``,
``host_pool``, ``kv_region`` and ``wait_timer`` do not import vLLM.
"""
