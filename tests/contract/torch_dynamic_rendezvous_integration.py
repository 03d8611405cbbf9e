# Vendored from PyTorch: test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py
# (commit 584cfb1c6279fde66bea473c0adc4cbbd4ad8598): IntegrationTest and the helpers it
# uses, unchanged but for: the imports; these header lines; setUp taking its backend from
# the subclass (_make_backend) instead of torch's in-memory one; keep_alive_interval given
# as an int, the form torch 2.13's create_handler reads (get_as_int); and without the two
# test_share_tcp_store_* tests, which patch dist.PrefixStore and then spec a Mock on the
# patched class (refused by unittest.mock on Python 3.11) and use no backend.
# PyTorch is distributed under the BSD-3-Clause license:
#
# Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)
# Copyright (c) Facebook, Inc. and its affiliates.
# All rights reserved.
#
# Redistribution and use in source and binary forms, with or without
# modification, are permitted provided that the following conditions are met:
#
# 1. Redistributions of source code must retain the above copyright
#    notice, this list of conditions and the following disclaimer.
#
# 2. Redistributions in binary form must reproduce the above copyright
#    notice, this list of conditions and the following disclaimer in the
#    documentation and/or other materials provided with the distribution.
#
# 3. Neither the names of Facebook, Deepmind Technologies, NYU, NEC Laboratories America
#    and IDIAP Research Institute nor the names of its contributors may be
#    used to endorse or promote products derived from this software without
#    specific prior written permission.
#
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"
# AND ANY EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE
# IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE
# ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT OWNER OR CONTRIBUTORS BE
# LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR
# CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF
# SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS
# INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN
# CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE)
# ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE
# POSSIBILITY OF SUCH DAMAGE.
"""torch's own integration test of its dynamic rendezvous, on any backend (see the header)."""

import os
import pickle
import threading
import time
from collections.abc import Callable
from unittest import TestCase
from unittest.mock import patch

from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler,
    DynamicRendezvousHandler,
    RendezvousBackend,
)


def _ignore_exception(exception_type: Exception, fn: Callable):
    try:
        fn()
    except exception_type:
        pass


def _wait_for(condition, timeout=10, interval=1, name=None):
    def _wait_while():
        while True:
            if condition():
                break
            else:
                time.sleep(interval)

    wait_thread = threading.Thread(target=_wait_while, name=name)
    wait_thread.start()
    wait_thread.join(timeout=timeout)


class _CapturingThread(threading.Thread):
    def __init__(self, target=None, name=None, args=None, kwargs=None):
        if args is None:
            args = ()
        if kwargs is None:
            kwargs = {}
        threading.Thread.__init__(
            self, target=target, args=args, kwargs=kwargs, name=name
        )
        self._result = None

    def run(self):
        if self._target is not None:
            self._result = self._target(*self._args, **self._kwargs)

    def join(self, *args):
        threading.Thread.join(self, *args)
        return self._result


class IntegrationTest(TestCase):
    def _make_backend(self) -> RendezvousBackend:
        raise NotImplementedError

    def setUp(self) -> None:
        self._store = HashStore()
        self._handlers = []
        self._backend = self._make_backend()

    def tearDown(self) -> None:
        for handler in self._handlers:
            handler._stop_heartbeats()

    def _create_handler(self, **kwargs) -> DynamicRendezvousHandler:
        params = {
            "backend": self._backend.name,
            "endpoint": "dummy_endpoint",
            "run_id": "dummy_run_id",
            "min_nodes": 2,
            "max_nodes": 2,
            "join_timeout": "5",
            "local_addr": f"127.0.0.{len(self._handlers)}",
        }
        params.update(**kwargs)

        rzdv_params = RendezvousParameters(**params)

        handler = create_handler(self._store, self._backend, rzdv_params)
        self._handlers.append(handler)
        return handler

    def test_all_nodes_join_rendezvous(self) -> None:
        handler1 = self._create_handler(min_nodes=2, max_nodes=2)
        handler2 = self._create_handler(min_nodes=2, max_nodes=2)

        handler1_thread = _CapturingThread(target=handler1.next_rendezvous)
        handler2_thread = _CapturingThread(target=handler2.next_rendezvous)

        handler1_thread.start()
        handler2_thread.start()

        rdzv_info1: RendezvousInfo = handler1_thread.join()
        rdzv_info2: RendezvousInfo = handler2_thread.join()
        self.assertEqual(rdzv_info1.store.underlying_store, self._store)
        self.assertEqual(rdzv_info2.store.underlying_store, self._store)

        self.assertNotEqual(rdzv_info1.rank, rdzv_info2.rank)

        self.assertEqual(rdzv_info1.world_size, 2)
        self.assertEqual(rdzv_info2.world_size, 2)

    def test_redundancy_list(self) -> None:
        handler1 = self._create_handler(min_nodes=2, max_nodes=2)
        handler2 = self._create_handler(min_nodes=2, max_nodes=2)
        handler3 = self._create_handler(min_nodes=2, max_nodes=2)

        handler1_thread = _CapturingThread(target=handler1.next_rendezvous)
        handler2_thread = _CapturingThread(target=handler2.next_rendezvous)
        handler3_thread = _CapturingThread(
            target=_ignore_exception,
            args=(RendezvousTimeoutError, lambda: handler3.next_rendezvous()),
        )

        handler1_thread.start()
        handler2_thread.start()

        # establish successful rendezvous
        handler1_thread.join()
        handler2_thread.join()

        # expect to register in redundancy list
        handler3_thread.start()

        # wait until the handler3 is registered in the redundancy list
        _wait_for(lambda: pickle.loads(self._backend.get_state()[0]).redundancy_list)

        state_and_token = self._backend.get_state()
        state = pickle.loads(state_and_token[0])
        addresses = [node.addr for node in state.redundancy_list]
        self.assertListEqual(addresses, ["127.0.0.2"])

    def test_redundancy_transition_to_wait_list_then_join_rendezvous(self) -> None:
        handler1 = self._create_handler(
            min_nodes=1,
            max_nodes=2,
        )
        handler2 = self._create_handler(
            min_nodes=1,
            max_nodes=2,
            keep_alive_interval=1,
        )
        handler3 = self._create_handler(
            min_nodes=1,
            max_nodes=2,
        )

        handler1_thread = _CapturingThread(target=handler1.next_rendezvous)
        handler2_thread = _CapturingThread(target=handler2.next_rendezvous)

        handler3_thread = _CapturingThread(
            target=_ignore_exception,
            args=(RendezvousTimeoutError, lambda: handler3.next_rendezvous()),
        )

        handler1_thread.start()
        handler2_thread.start()

        # establish successful rendezvous
        handler1_thread.join()
        handler2_thread.join()

        handler3_thread.start()

        _wait_for(lambda: pickle.loads(self._backend.get_state()[0]).redundancy_list)

        handler2._stop_heartbeats()

        _wait_for(
            lambda: len(pickle.loads(self._backend.get_state()[0]).participants) == 1
        )
        _wait_for(
            lambda: len(pickle.loads(self._backend.get_state()[0]).wait_list) == 1
        )

    def test_use_agent_store_is_true_by_default(self):
        handler = self._create_handler(
            min_nodes=1,
            max_nodes=2,
        )

        self.assertTrue(handler.use_agent_store)

    @patch.dict(os.environ, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    def test_use_agent_store_is_disabled(self):
        handler = self._create_handler(
            min_nodes=1,
            max_nodes=2,
        )

        self.assertFalse(handler.use_agent_store)
