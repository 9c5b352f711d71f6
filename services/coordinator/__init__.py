"""The coordinator (syncer) service: global parameters, outer optimizer, round policy and shard ledger behind
the `diloco.v1.Coordinator` gRPC API. Layout: `config` (flags/env), `state` (the locked core, uploads,
parameter snapshots), `servicer` (protos <-> state), `server` (wiring, background work), `checkpoint`."""
