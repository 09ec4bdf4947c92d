"""Interview preparation on the course's own checkers.

    minikv quiz                 questions with model answers, by topic or difficulty (bank.py, quiz.py)
    minikv drill list/start/check   timed coding drills, checked on hidden random cases (drills.py)
    minikv bugs list/start/check    the real engine with one planted bug to find (bugs.py)

The question bank is data (data/*.json), the drills' starters and references are files
(drill_files/), and the bug labs are the engine's named seams with a buggy function in them
(bug_files/): nothing here edits the engine.
"""
