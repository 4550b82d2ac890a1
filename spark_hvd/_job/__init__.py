"""What a rank and its launcher share: the job below the collective API.

- ``env``: the launch contract, the SPARK_HVD_* variables a launcher sets for a
  rank and how the rank reads them back;
- ``topology``: where each rank sits (local and cross rank);
- ``wire``, ``store``, ``client``: the rendezvous protocol, its key-value store
  contract and the client a rank (and the core, as its Store) talks through.

Only the standard library, ``spark_hvd.exceptions`` and ``spark_hvd._config`` are
imported from here: the collective API (``spark_hvd._basics``) builds on it, and so
do the launchers and the rendezvous server (``spark_hvd.runner``), above it.
"""
