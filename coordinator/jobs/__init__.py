"""Tools that run a job with the coordinator on, without code changes: ``launcher``
(``coordinator-run``, a torchrun drop-in) and ``slurm`` (a prolog and epilog that warm each
node's caches from a bundle and save the job's)."""
