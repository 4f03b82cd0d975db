"""One conversion in a child process, for the interrupt test.

Lives in its own module so the multiprocessing forkserver can import it without the
test module (and pytest's state) coming along.
"""

import os


def convert(src, dst, overwrite, conn):
    import packed_ss_jax as ps

    conn.send("ready")
    try:
        ps.convert(src, dst, dtype="float32", lora=True, overwrite=overwrite, progress=False)
    except KeyboardInterrupt:  # Interrupted (SIGINT or SIGTERM)
        conn.send("interrupted")
        os._exit(3)
    except BaseException as e:  # anything else is a bug the test reports
        conn.send(f"error: {type(e).__name__}: {e}")
        os._exit(4)
    conn.send("done")
    os._exit(0)
