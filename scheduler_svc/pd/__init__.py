"""PD disaggregation: the prefill and decode engines, and the router in front of them.

- :mod:`.prefill` (``PrefillEngine``) and :mod:`.decode` (``DecodeEngine``): the two
  nodes' scheduling loops; :mod:`.rooms`: what both share;
- :mod:`.router` (``python -m scheduler_svc.pd.router``): the PD front, which pairs the
  nodes' halves of each request (:mod:`.flight`), acts on the nodes' replies
  (:mod:`.node_replies`) and catches up a node whose scheduler restarted (:mod:`.node_watch`).

Both reuse :class:`Engine`; what differs is where a request's KV comes from
and where it goes::

    prefill node: waiting ─► prefill (Engine's admission) ─► pd_send ─► inflight ─► Success:
                  release into the prefix tree, reply with the first token  | Failed: free, 500

    decode node:  prealloc queue ─► row + pages reserved, pd_expect ─► transfer queue ─►
                  Success: join the running batch with the first token (no compute) | Failed: 500
                  running ─► retract: KV offloaded to memsvc-D's host store ─► retracted queue
                  retracted ─► resume FIFO (load back into new pages) ─► running

On the decode node, while anything is retracted no preallocation starts and no
transfer is committed (SGLang's ``process_decode_queue``): the parked requests
come back first. The prefill node is never involved in that recovery.

When a node's memsvc loses the scheduler's KV (it restarted, or expired the
session), :class:`scheduler_svc.recovery.Recovery` calls the engine's
``requeue_kv_holders``: the prefill node prefills again every request that
held KV there, and sends it to the same room (the decode side still waits
for it); the decode node, which cannot prefill, re-bootstraps every
request that held KV there (running, retracted to its host store, in the
transfer queue) through the prefill node under a fresh room.
"""
