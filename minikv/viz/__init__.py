"""minikv.viz: pictures and widgets of the engine's own state, one module per notebook topic.

    memory     the KV cache's size: calculator and plot over minikv/model/shapes.py (notebooks 00, 02)
    recompute  what each step computes and reads, naive or cached, with running totals (01, 02)
    batching   static batching's grid of slots and its waste (03)
    pool       record_trace (watches a paged engine through llm.add_observer), the pool step by step (04, 05, 07)
    timeline   a request's life per step: waiting, prefill, decode, preempted, swapped (05)
    prefix     the hash chain and the radix tree, growing and evicted; time to first token (06)
    decode     which split of the paged decode kernel reads which block (08)
    questions  the question bank, one topic at a time, answers folded (12)
    view       the fallback a saved notebook shows for a widget: a sentence, its answer, its picture

Every widget takes what it draws as arguments when it is built and reads nothing else: no notebook
variable can change or break it after its cell has run.
"""
