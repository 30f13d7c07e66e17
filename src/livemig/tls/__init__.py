"""TLS between the two ends of a migration: a small PKI (:mod:`.pki`), finding the
credentials a host already has (:mod:`.creds`), and the QMP objects and parameters
that turn TLS on for one migration (:mod:`.qmp`)."""
