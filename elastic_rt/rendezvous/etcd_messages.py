"""etcd's v3 protobuf messages for our KV operations, and our records from its replies.

Pure builders with no connection: the blocking client (``etcd_kv``) and the rendezvous
benchmark's asyncio client send the same requests, so a transaction means the same
compare-and-write whichever sends it.
"""

from __future__ import annotations

from typing import Any, Sequence

import etcd3.utils
from etcd3 import etcdrpc

from elastic_rt.rendezvous.kv import Delete, Get, KeyValue, TxnOp, TxnResult


def txn_request(expect: dict[str, int], success: Sequence[TxnOp],
                failure: Sequence[TxnOp] = ()) -> Any:
    """etcd's ``TxnRequest`` for :meth:`KVStore.txn` (both clients send it).

    A compare on revision 0 means "absent" (version 0), any other on the key's
    mod_revision.
    """
    compares = [
        etcdrpc.Compare(key=key.encode(), result=etcdrpc.Compare.EQUAL,
                        target=etcdrpc.Compare.VERSION, version=0) if rev == 0 else
        etcdrpc.Compare(key=key.encode(), result=etcdrpc.Compare.EQUAL,
                        target=etcdrpc.Compare.MOD, mod_revision=rev)
        for key, rev in expect.items()
    ]
    return etcdrpc.TxnRequest(compare=compares, success=[_request_op(op) for op in success],
                              failure=[_request_op(op) for op in failure])


def _request_op(op: TxnOp) -> Any:
    """etcd's request for one operation (the client's own ``Get`` has no limit)."""
    if isinstance(op, Get):
        end = etcd3.utils.prefix_range_end(op.key.encode()) if op.prefix else b""
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
            key=op.key.encode(), range_end=end, limit=op.limit))
    if isinstance(op, Delete):
        return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
            key=op.key.encode()))
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
        key=op.key.encode(), value=op.value, lease=op.lease or 0))


def txn_result(response: Any) -> TxnResult:
    """A :class:`TxnResult` from etcd's ``TxnResponse``: one list per read, in order."""
    reads = [[pb_kv(kv) for kv in r.response_range.kvs] for r in response.responses
             if r.WhichOneof("response") == "response_range"]
    return TxnResult(bool(response.succeeded), int(response.header.revision), reads)


def pb_kv(kv: Any) -> KeyValue:
    """A KeyValue from etcd's own protobuf record (a range or watch result)."""
    return KeyValue(key=kv.key.decode(), value=bytes(kv.value), mod_revision=int(kv.mod_revision),
                    create_revision=int(kv.create_revision), lease=int(kv.lease))
