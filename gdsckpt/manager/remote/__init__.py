"""The object-store tier: steps uploaded in the background (`tier`), the marker that says an
upload is complete (`marker`), and the check that the store's objects are the file's (`verify`).

May import: `stores`, `manager.steps`, `manager.policy` and everything below them."""
