"""Pipeline schedules: the Schedule IR (:mod:`.ir`), generators (:mod:`.generators`), validator (:mod:`.validate`),
text format (:mod:`.textio`) and the ``stratum schedule`` CLI (:mod:`.cli`)."""
