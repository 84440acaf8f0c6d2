"""The Checkpointer (`checkpointer`): steps in a directory (`steps`: one file per step, or a DCP
directory per step), which to keep (`policy`, applied off the caller's thread by `retention`),
rollbacks (`rollback`), and its two other tiers: host memory (`memory/`) and an object store
(`remote/`).

May import everything below it: `core`, `format`, `engine`, `writing`, `reading`, `stores`,
`dcp`, `api`, `errors`, `stats`."""
