package sparksteward.shim

import java.io.{BufferedReader, IOException, InputStreamReader, OutputStream}
import java.nio.charset.StandardCharsets.UTF_8
import java.util.concurrent.{ArrayBlockingQueue, CountDownLatch, TimeUnit}
import java.util.concurrent.atomic.{AtomicBoolean, AtomicLong}

import com.fasterxml.jackson.databind.ObjectMapper
import org.slf4j.LoggerFactory

/** What the agent answered on stdout: `ready` or `fatal` (docs/protocol.md). */
sealed trait AgentAnswer
final case class Ready(endpoint: String, shutdownGraceMs: Long) extends AgentAnswer
final case class Fatal(code: String, message: String) extends AgentAnswer
final case class Failed(message: String) extends AgentAnswer

object AgentAnswer {
  private val mapper = new ObjectMapper()

  /** Parse one stdout line; None for lines that are not ready/fatal. */
  def parse(line: String): Option[AgentAnswer] =
    try {
      val node = mapper.readTree(line)
      if (node == null || node.path("v").asInt(-1) != Messages.Version) None
      else node.path("type").asText() match {
        case "ready" => Some(Ready(node.path("endpoint").asText(), node.path("shutdown_grace_ms").asLong(35000L)))
        case "fatal" => Some(Fatal(node.path("code").asText(), node.path("message").asText()))
        case _ => None
      }
    } catch { case _: Exception => None }
}

/** Starts, feeds and supervises one Python agent. Events are enqueued without blocking (dropped when
 *  the bounded queue is full); one writer thread drains them into the agent's stdin. An agent that
 *  dies after `ready` is restarted up to `maxRestarts` times with `hello` sent again. */
class AgentProcess(role: String, command: Seq[String], hello: String, maxRestarts: Int) {
  private val log = LoggerFactory.getLogger("sparksteward.shim")
  private val queue = new ArrayBlockingQueue[String](10000)
  private val dropped = new AtomicLong(0)
  private val stopping = new AtomicBoolean(false)
  private val answered = new CountDownLatch(1)
  @volatile private var answer: AgentAnswer = Failed("the agent has not answered yet")
  @volatile private var process: Process = _
  @volatile private var stdin: OutputStream = _
  private val ShutdownLine = "\u0000shutdown"

  private val writer = new Thread(() => supervise(), s"steward-$role-agent")
  writer.setDaemon(true)

  def start(): Unit = writer.start()

  // lines a restarted agent must see again right after hello (app_start)
  @volatile private var replay: Vector[String] = Vector.empty

  /** Enqueue one event line; never blocks, never throws. A `sticky` line is replayed to a restarted agent. */
  def send(line: String, sticky: Boolean = false): Unit = {
    if (sticky) replay = replay :+ line
    if (!queue.offer(line)) {
      val n = dropped.incrementAndGet()
      if (n % 1000 == 1) log.warn(s"spark-steward $role agent is not keeping up: dropped $n events")
    }
  }

  /** Wait for `ready` / `fatal` / start failure, up to `timeoutMs`. */
  def awaitAnswer(timeoutMs: Long): AgentAnswer =
    if (answered.await(timeoutMs, TimeUnit.MILLISECONDS)) answer
    else Failed(s"the $role agent did not report ready within ${timeoutMs / 1000} s " +
      "(spark.steward.agent.start-timeout); see its lines in this log")

  private def launch(restart: Boolean): Process = {
    val pb = new ProcessBuilder(command: _*)
    pb.redirectError(ProcessBuilder.Redirect.INHERIT)
    val p = pb.start()
    stdin = p.getOutputStream
    stdin.write((hello + "\n").getBytes(UTF_8))
    if (restart) replay.foreach(l => stdin.write((l + "\n").getBytes(UTF_8)))
    stdin.flush()
    val reader = new Thread(() => readAnswers(p), s"steward-$role-agent-stdout")
    reader.setDaemon(true)
    reader.start()
    p
  }

  private def readAnswers(p: Process): Unit = {
    val in = new BufferedReader(new InputStreamReader(p.getInputStream, UTF_8))
    try {
      var line = in.readLine()
      while (line != null) {
        AgentAnswer.parse(line) match {
          case Some(a) => answer = a; answered.countDown()
          case None => log.debug(s"$role agent: $line")
        }
        line = in.readLine()
      }
    } catch { case _: IOException => () }
  }

  private def supervise(): Unit = {
    var restarts = 0
    var backoffMs = 1000L
    var running = true
    while (running) {
      try {
        process = launch(restarts > 0)
        running = pump(process)
      } catch {
        case e: IOException =>
          answer = Failed(s"cannot start the $role agent with `${command.mkString(" ")}`: ${e.getMessage}. " +
            "Set spark.steward.agent.python (or PYSPARK_PYTHON) to a Python that has spark-steward installed.")
          answered.countDown()
          return
      }
      if (running) {
        val code = try process.waitFor() catch { case _: InterruptedException => -1 }
        val wasReady = answer.isInstanceOf[Ready]
        if (!wasReady) {
          if (answered.getCount > 0) {
            answer = Failed(s"the $role agent exited with code $code before it was ready; its stderr is in this log")
            answered.countDown()
          }
          running = false
        } else if (stopping.get() || restarts >= maxRestarts) {
          log.error(s"spark-steward $role agent exited with code $code; not restarting")
          running = false
        } else {
          restarts += 1
          log.error(s"spark-steward $role agent exited with code $code; restart $restarts of $maxRestarts in ${backoffMs} ms")
          Thread.sleep(backoffMs)
          backoffMs *= 2
        }
      }
    }
  }

  /** Copy queued lines to the agent until shutdown (returns false) or the agent dies (returns true). */
  private def pump(p: Process): Boolean = {
    while (true) {
      val line = queue.poll(200, TimeUnit.MILLISECONDS)
      if (line == ShutdownLine) { closeStdin(); return false }
      if (line != null) {
        try { stdin.write((line + "\n").getBytes(UTF_8)); stdin.flush() }
        catch { case _: IOException => if (!p.isAlive) return !stopping.get() }
      } else if (!p.isAlive) return !stopping.get()
    }
    false
  }

  private def closeStdin(): Unit = try { if (stdin != null) stdin.close() } catch { case _: IOException => () }

  /** Send `shutdown`, close stdin, wait for the announced grace period, then kill. Idempotent. */
  def stop(): Unit = if (stopping.compareAndSet(false, true)) {
    try {
      if (writer.isAlive) {
        queue.offer(Messages.shutdown(System.currentTimeMillis(), "plugin shutdown"), 1, TimeUnit.SECONDS)
        queue.offer(ShutdownLine, 1, TimeUnit.SECONDS)
        writer.join(10000)
      }
      closeStdin()
      val grace = answer match { case Ready(_, ms) => ms; case _ => 5000L }
      val p = process
      if (p != null && !p.waitFor(grace, TimeUnit.MILLISECONDS)) {
        log.warn(s"spark-steward $role agent did not exit within $grace ms; killing it")
        p.destroyForcibly().waitFor(5, TimeUnit.SECONDS)
      }
    } catch {
      case t: Throwable => log.warn(s"stopping the spark-steward $role agent failed: $t")
    }
  }
}
