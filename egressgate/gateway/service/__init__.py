"""The gateway process: `egressgate run` wiring (app.py), workers and their supervisor, inherited listeners, the
var-dir lock, the CA, the DNS resolver client, the reconcile sweep.
"""
