"""gdsckpt-bench: fio-style save/restore measurements, with the usual alternatives side by side."""
