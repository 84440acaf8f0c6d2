"""Peer replicas: each rank's memory copy of a step also held in the memory of ranks on other
nodes, so that a node's loss costs no step (docs/replicas.md). `placement` (which ranks hold whose
copies: a ring over nodes, or a mapping), `wire` (the images sent in the background on process
groups of their own), `store` (the holder's side: replicas checked chunk by chunk, then
committed, under the rank's memory cap), `restore` (the ranks' agreement on a step every rank can
get, and a lost rank's copy received from its holder).

May import: `manager.memory` and everything below the manager."""
