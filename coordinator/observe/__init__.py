"""What a rank did, for the people who run the job: ``stats`` (one counting source, the
summary line), ``trace`` (a rank's events on a timeline), ``report`` (``coordinator report``:
the ranks merged) and ``logs`` (the coordinator's log lines, prefixed by rank)."""
