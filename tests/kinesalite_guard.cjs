// Preloaded into kinesalite (node --require) by tests/kinesis_server.py.
//
// kinesalite rethrows a request's 'error' event (index.js: req.on('error', err => { throw err })),
// so a client that dies with a request in flight -- a driver killed with SIGKILL mid-call --
// takes the whole server down, and every later call is refused. Real Kinesis does not die
// when one of its clients does. A request that was aborted never reached kinesalite's handler
// (it acts on 'end'), so ignoring that one error leaves the store unchanged; any other
// uncaught error still ends the server, as before.
process.on('uncaughtException', (err) => {
  if (err && err.code === 'ECONNRESET' && err.message === 'aborted') {
    console.error(`kinesalite guard: a client hung up with a request in flight; ignored`);
    return;
  }
  console.error(err);
  process.exit(70);
});
