package sparksteward.shim

import java.io.{BufferedReader, IOException, InputStreamReader, OutputStream}
import java.nio.charset.StandardCharsets.UTF_8
import java.util.concurrent.{ArrayBlockingQueue, CompletableFuture, ConcurrentHashMap, CountDownLatch, TimeUnit}
import java.util.concurrent.atomic.{AtomicBoolean, AtomicLong}

import com.fasterxml.jackson.databind.{JsonNode, ObjectMapper}
import org.slf4j.LoggerFactory

/** What the agent answered on stdout: `ready` or `fatal` (docs/protocol.md), or why it could not. */
sealed trait AgentAnswer
final case class Ready(endpoint: String, shutdownGraceMs: Long) extends AgentAnswer
final case class Fatal(code: String, message: String) extends AgentAnswer
final case class Failed(message: String) extends AgentAnswer

object AgentAnswer {
  val DefaultGraceMs = 35000L
  val mapper = new ObjectMapper()

  /** Parse one stdout line; None for lines that are not a v1 `ready`/`fatal`. Never throws. */
  def parse(line: String): Option[AgentAnswer] =
    try {
      val node = mapper.readTree(line)
      if (node == null || !node.isObject || node.path("v").asInt(-1) != Messages.Version) None
      else node.path("type").asText() match {
        case "ready" => Some(Ready(node.path("endpoint").asText(), node.path("shutdown_grace_ms").asLong(DefaultGraceMs)))
        case "fatal" => Some(Fatal(node.path("code").asText(), node.path("message").asText()))
        case _ => None
      }
    } catch { case _: Exception => None }
}

/** Starts, feeds and supervises one Python agent.
 *
 *  Thread-safety: `send` may be called from any thread and never blocks; lines go to a bounded queue
 *  (dropped, and counted, when it is full). One writer thread owns the process: it launches it, writes
 *  `hello`, drains the queue into its stdin and restarts an agent that dies after `ready` (up to
 *  `maxRestarts` times, backoff 1 s, 2 s, 4 s ...), never after `fatal`. A reader thread per process
 *  records `ready`/`fatal` from its stdout. `stop` is idempotent and never throws. */
class AgentProcess(role: String, command: Seq[String], hello: String, maxRestarts: Int) {
  private val log = LoggerFactory.getLogger("sparksteward.shim")
  private val queue = new ArrayBlockingQueue[String](10000)
  private val dropped = new AtomicLong(0)
  private val stopping = new AtomicBoolean(false)
  private val answered = new CountDownLatch(1)
  private val EndOfInput = "\u0000end-of-input" // queue marker: close stdin after the lines before it
  private val logName = if (role == "driver") "driver log" else "executor log"
  @volatile private var answer: AgentAnswer = Failed(s"the $role agent has not answered yet")
  @volatile private var process: Process = _
  @volatile private var stdin: OutputStream = _
  @volatile private var reader: Thread = _
  @volatile private var replay: Vector[String] = Vector.empty // sent again after hello to a restarted agent

  /** The latest value of each number of the agent's `metrics` lines; `onNewMetric` sees each new name once. */
  val metrics = new ConcurrentHashMap[String, java.lang.Double]()
  val metricsLines = new AtomicLong(0)
  @volatile var onNewMetric: String => Unit = _ => ()

  private val pending = new ConcurrentHashMap[Long, CompletableFuture[JsonNode]]()
  private val requestIds = new AtomicLong(0)
  private val writer = new Thread(() => supervise(), s"steward-$role-agent")
  writer.setDaemon(true)

  def start(): Unit = writer.start()

  private def rootLevel() = try org.apache.logging.log4j.LogManager.getRootLogger.getLevel.name catch { case _: Throwable => "" }
  @volatile private var level = "" // the JVM's log4j level as last sent to the agent: the first line says it

  /** Enqueue one event line, after a `log_level` line first and when the JVM's level changed (sc.setLogLevel);
   *  never blocks, never throws. A `sticky` line is replayed to a restarted agent. */
  def send(line: String, sticky: Boolean = false): Unit = {
    val now = rootLevel()
    if (now != level) { level = now; send(Messages.encode("log_level", "level" -> now), sticky = true) }
    if (sticky) replay = replay :+ line
    if (!queue.offer(line)) {
      val n = dropped.incrementAndGet()
      if (n % 1000 == 1) log.warn(s"spark-steward $role agent is not keeping up: $n events dropped so far")
    }
  }

  /** Wait up to `timeoutMs` for `ready`, `fatal`, or the reason the agent could not answer. */
  def awaitAnswer(timeoutMs: Long): AgentAnswer =
    if (answered.await(timeoutMs, TimeUnit.MILLISECONDS)) answer
    else Failed(s"the $role agent did not report ready within $timeoutMs ms " +
      s"(spark.steward.agent.start-timeout); look at the $logName for its stderr")

  /** One request over the pipes (decision 0009): `kind` with `fields` and a fresh `id` on stdin, answered
   *  by the `reply` line with that id on stdout. Returns the reply; throws IOException after `timeoutMs`, or
   *  at once if the agent exits. Blocks the calling thread only. */
  def call(kind: String, timeoutMs: Long, fields: (String, Any)*): JsonNode = {
    val id = requestIds.incrementAndGet()
    val reply = new CompletableFuture[JsonNode]()
    pending.put(id, reply)
    try {
      if (stopping.get() || !queue.offer(Messages.encode(kind, (("id" -> id) +: fields): _*), timeoutMs,
          TimeUnit.MILLISECONDS)) throw new IOException(s"the spark-steward $role agent is stopping or not keeping up")
      reply.get(timeoutMs, TimeUnit.MILLISECONDS)
    } catch {
      case _: java.util.concurrent.TimeoutException => throw new IOException(s"the spark-steward $role agent did " +
        s"not answer $kind within $timeoutMs ms (spark.steward.fs.timeout); look at the $logName")
      case e: java.util.concurrent.ExecutionException => throw e.getCause
    } finally pending.remove(id)
  }

  private def completeReply(line: String): Unit = try {
    val node = AgentAnswer.mapper.readTree(line)
    if (node.path("type").asText() == "reply") Option(pending.get(node.path("id").asLong(-1))).foreach(_.complete(node))
  } catch { case _: Exception => log.warn(s"$role agent: unreadable reply line: $line") }

  private def updateMetrics(line: String): Unit = try {
    AgentAnswer.mapper.readTree(line).path("values").fields().forEachRemaining { e =>
      if (e.getValue.isNumber && metrics.put(e.getKey, e.getValue.asDouble) == null) onNewMetric(e.getKey)
    }
    metricsLines.incrementAndGet()
  } catch { case e: Exception => log.warn(s"$role agent: unreadable metrics line ($e): $line") }

  private def failPending(why: String): Unit =
    pending.values.forEach(f => f.completeExceptionally(new IOException(why)))

  private def setAnswer(a: AgentAnswer): Unit = { answer = a; answered.countDown() }

  private def launch(restart: Boolean): Process = {
    val pb = new ProcessBuilder(command: _*).redirectError(ProcessBuilder.Redirect.INHERIT)
    val p = pb.start()
    stdin = p.getOutputStream
    write(hello)
    if (restart) replay.foreach(write)
    stdin.flush()
    val r = new Thread(() => readAnswers(p), s"steward-$role-agent-stdout")
    r.setDaemon(true)
    r.start()
    reader = r
    p
  }

  private def write(line: String): Unit = stdin.write((line + "\n").getBytes(UTF_8))

  private def readAnswers(p: Process): Unit = try {
    val in = new BufferedReader(new InputStreamReader(p.getInputStream, UTF_8))
    var line = in.readLine()
    while (line != null) {
      if (line.startsWith(Messages.MetricsPrefix)) updateMetrics(line)
      else if (line.contains("\"reply\"")) completeReply(line)
      else AgentAnswer.parse(line) match {
        case Some(a) => setAnswer(a)
        case None => log.debug(s"$role agent: $line")
      }
      line = in.readLine()
    }
  } catch { case _: IOException => () }
  finally failPending(s"the spark-steward $role agent exited before answering; look at the $logName")

  private def supervise(): Unit = try {
    var restarts = 0
    var backoffMs = 1000L
    while (true) {
      val p = try launch(restarts > 0) catch {
        case e: IOException =>
          setAnswer(Failed(s"cannot run `${command.head}` to start the $role agent (${e.getMessage}); set " +
            "spark.steward.agent.python or PYSPARK_PYTHON to a Python that has spark-steward installed"))
          return
      }
      process = p
      if (!pump(p)) return // stdin closed on shutdown
      val code = p.waitFor()
      val r = reader
      if (r != null) r.join(2000) // a fatal line printed just before exit must win over "exited"
      answer match {
        case _: Ready if !stopping.get() && restarts < maxRestarts =>
          restarts += 1
          log.error(s"spark-steward $role agent exited with code $code; restart $restarts of $maxRestarts " +
            s"in $backoffMs ms (its stderr is in the $logName)")
          Thread.sleep(backoffMs)
          backoffMs *= 2
          if (stopping.get()) return
        case _: Ready =>
          if (!stopping.get()) log.error(s"spark-steward $role agent exited with code $code; not restarting " +
            s"after $restarts restarts (spark.steward.agent.max-restarts)")
          return
        case _: Fatal => return
        case _: Failed =>
          setAnswer(Failed(s"the $role agent exited with code $code before it was ready; " +
            s"look at the $logName for its stderr"))
          return
      }
    }
  } catch { case _: InterruptedException => () }

  /** Copy queued lines into the agent's stdin. Returns false once stdin is closed for shutdown, true
   *  when the agent died. Flushes whenever the queue is drained. */
  private def pump(p: Process): Boolean = {
    while (true) {
      val line = queue.poll(200, TimeUnit.MILLISECONDS)
      if (line == EndOfInput || (line == null && stopping.get())) { closeStdin(); return false }
      if (line != null) {
        try { write(line); if (queue.isEmpty) stdin.flush() }
        catch { case _: IOException => if (!p.isAlive) return !stopping.get() }
      } else if (!p.isAlive) return !stopping.get()
    }
    false
  }

  private def closeStdin(): Unit = try { if (stdin != null) stdin.close() } catch { case _: IOException => () }

  /** Send `shutdown`, close stdin, wait for the grace period the agent announced, then kill it. */
  def stop(): Unit = if (stopping.compareAndSet(false, true)) {
    try {
      if (writer.isAlive) {
        queue.offer(Messages.shutdown(System.currentTimeMillis(), "plugin shutdown"), 1, TimeUnit.SECONDS)
        queue.offer(EndOfInput, 1, TimeUnit.SECONDS)
        writer.join(10000)
      }
      closeStdin()
      val grace = answer match { case Ready(_, ms) => ms; case _ => AgentAnswer.DefaultGraceMs }
      val p = process
      if (p != null && !p.waitFor(grace, TimeUnit.MILLISECONDS)) {
        log.warn(s"spark-steward $role agent did not exit within $grace ms of shutdown; killing it")
        p.destroyForcibly().waitFor(5, TimeUnit.SECONDS)
      }
      writer.interrupt()
      writer.join(1000)
      val r = reader
      if (r != null) r.join(1000)
      if (dropped.get() > 0) log.warn(s"spark-steward $role agent: ${dropped.get()} events were dropped in total")
    } catch {
      case t: Throwable => log.warn(s"stopping the spark-steward $role agent failed: $t")
    }
  }
}
