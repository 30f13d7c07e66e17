import socket, threading, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname())
conn, _ = srv.accept()
state = {"sent": 0, "err": None, "done": False}
def writer():
    try:
        while True:
            state["sent"] += cli.send(b"x" * 65536)
    except OSError as e:
        state["err"] = e
    state["done"] = True
threading.Thread(target=writer, daemon=True).start()
time.sleep(1)  # let both buffers fill
print("before shutdown: sent", state["sent"], "blocked:", not state["done"])
conn.shutdown(socket.SHUT_RDWR)
time.sleep(3)
print("3 s after shutdown(RDWR): blocked:", not state["done"], state["err"])
conn.close()
time.sleep(1)
print("1 s after close: blocked:", not state["done"], state["err"])
