"""Drill: copy-on-write when a step writes into shared blocks (20 minutes).

Write copy_on_write(block_table, ref_count, start, end, block_size, allocate) -> [(src, dst), ...]

    the step writes positions [start, end) of one sequence; block_table already covers end - 1
    block_table  its physical blocks in logical order; change it in place: a copied block is
                 replaced by its copy
    ref_count    [num_blocks] how many block tables hold each block; change it in place
    allocate()   returns a free block id (ref_count 0)
    returns      the (src, dst) copies to make before the forward, in logical order

A block another table still holds (ref_count > 1) is never written: the writer gets a fresh block
(ref_count 1) and the shared one loses one holder. The last owner (ref_count 1) writes in place.
Example: table [3, 5], ref_count[5] = 2, block_size 4, the step writes position 6 ->
table [3, 8], ref_count[5] = 1, ref_count[8] = 1, returns [(5, 8)] when allocate() gives 8.

Check it with: minikv drill check copy-on-write
"""


def copy_on_write(block_table: list[int], ref_count: list[int], start: int, end: int, block_size: int,
                  allocate) -> list[tuple[int, int]]:
    raise NotImplementedError("write copy_on_write")
