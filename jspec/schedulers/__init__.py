"""The two schedulers behind one interface (base.Scheduler), one picked per LLM at build time
(jspec.build.SCHEDULERS, from `batching=`): `continuous` (slots refilled inside the loop) and
`waves` (batches that end with their longest request)."""
