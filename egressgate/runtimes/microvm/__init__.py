"""`--runtime microvm`: QEMU microvm guests (adapter.py), their artifacts and root images."""
