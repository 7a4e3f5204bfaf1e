"""The grader behind `course grade`: every submission graded in isolation, one job per module.

For each submission (a notebook file, or a folder holding one):
  read       it safely: no links, devices or hard links, a size cap, valid JSON (submission);
  assemble   the graded notebook from the source: cells matched by grade_id, so inserted, moved
             or split cells do not matter; tests (with their hidden part) and locked cells come
             from the source, edited or deleted ones are restored and flagged (assemble);
  run        it in course.grading.sandbox, isolated (own uid, no network, a bubblewrap file view
             built from an allowlist, private /tmp and PIDs, its slot's cores, cgroup limits,
             rlimits; refused without it: isolation), every cell even after failures, a per-cell
             timeout and a wall-clock budget, then kill everything it started (runner);
  check      each test cell in two halves (cells): its probe runs in the sandboxed kernel and
             sends plain data out (plain); its check runs on that data in a fresh interpreter of
             the grader's (verdict), so nothing a submission does to its own kernel can make a
             test pass, and hidden checks never enter the sandbox;
  score      full points when the check runs to its end, a number it ends with is partial
             credit (capped), stderr never costs points; written answers wait for a human
             (runner, results);
  report     the gradebook and one feedback page per student, nothing of the student's able to
             run in it (reports).
The batch (course.grade) runs submissions in parallel slots and rewrites the gradebook
atomically after every one, so Ctrl-C keeps every finished grade; a re-run skips submissions
already graded and unchanged, and slices graded on several machines merge into one (shards).

Modules, in the order a submission meets them:
  results      Question, Result, Limits: what a grade is made of; the lab's questions
  submission   load_submission: a submitted file or folder read without following links;
               names: the name each is graded under, or why it is refused
  assemble     the notebook to run, and each test cut to its probe (the checks stay here)
  isolation    what the machine allows (uids, namespaces, bubblewrap, cgroups), the block of
               uids a grader holds, a submission's processes and their limits
  runner       Job, grade_one: one submission end to end (sandbox, watch, verdicts, executed
               notebook)
  sandbox      the process that runs a notebook in bubblewrap and streams the probes' data out
  client       its notebook client: what the kernel sends back, capped and filtered
  _kernel_shim the kernel's start: limits, cores, environment, uid, then ipykernel; and the
               hidden part of a probe, run from a file so that no history of the kernel keeps it
  seeds        each submission's hidden seed, from the run's key kept in its output folder
  plain        the only data that leaves a kernel, and how it is rebuilt outside
  verdict      the checks, run on that data in an interpreter of the grader's
  cells        the authoring format: nbgrader metadata, markers, probe and check
  reports      gradebook.csv, the feedback pages, the batch's one-line summary
  shards       an output folder's bookkeeping: the resume key, slices and their merge

Imports run one way: these modules may import course.release, course.kernel, course.syllabus
and helpers, never course.grade or course.cli. This file imports nothing: the sandboxed kernel
imports course.grading.plain (and _kernel_shim, for hidden pieces), and must load no more of
the grader than that.
"""
