"""The memory tier: each rank's newest steps held in shared memory, outliving the process.

`tier` (the folder, its slots and commit records, bounded by a cap), `slot` (one segment),
`folders` (naming, identity and ownership of tier folders), `snapshot` (save_async into a slot),
`source` (reading a copy back), `steps` (the Checkpointer's use of the tier, and the ranks'
agreement under torch.distributed), `ranks` (a rank's DCP view in its tier), `local_writes`
(copies written to the directory in the background).

May import: `manager` (its steps and policy) and everything below it."""
