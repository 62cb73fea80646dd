package sparksteward.shim

import java.net.{InetAddress, InetSocketAddress, ServerSocket}
import java.nio.file.Paths
import java.security.SecureRandom
import java.util.{Map => JMap}

import scala.jdk.CollectionConverters._
import scala.util.control.NonFatal

import com.codahale.metrics.Gauge
import org.apache.spark.{ExceptionFailure, SparkConf, SparkContext, SparkEnv, SparkException, SparkFiles, TaskContext,
  TaskFailedReason}
import org.apache.spark.api.plugin.{DriverPlugin, ExecutorPlugin, PluginContext, SparkPlugin}

/** spark-steward's Spark plugin: starts and supervises the Python agents and forwards Spark's
 *  lifecycle events to them (docs/protocol.md). All logic lives in the agents (python/sparksteward). */
class StewardPlugin extends SparkPlugin {
  override def driverPlugin(): DriverPlugin = new StewardDriverPlugin
  override def executorPlugin(): ExecutorPlugin = new StewardExecutorPlugin
}

object StewardPlugin {
  val ConfPrefix = "spark.steward."
  private val forwarded = Set("spark.app.name", "spark.master", "spark.checkpoint.dir", "spark.log.level")

  /** The `conf` object of `hello`: every spark.steward.* entry plus a few of Spark's own. */
  def agentConf(conf: SparkConf): Map[String, String] =
    conf.getAll.filter { case (k, _) => k.startsWith(ConfPrefix) || forwarded.contains(k) }.toMap

  /** The Python for an agent, chosen like PySpark chooses its own. */
  def python(conf: SparkConf, role: String): String = {
    val keys = if (role == "driver") Seq("spark.steward.agent.python", "spark.pyspark.driver.python", "spark.pyspark.python")
               else Seq("spark.steward.agent.python", "spark.pyspark.python")
    val envs = if (role == "driver") Seq("PYSPARK_DRIVER_PYTHON", "PYSPARK_PYTHON") else Seq("PYSPARK_PYTHON")
    (keys.flatMap(conf.getOption) ++ envs.flatMap(sys.env.get)).map(_.trim).find(_.nonEmpty).getOrElse("python3")
  }

  def agent(conf: SparkConf, role: String, hello: String): AgentProcess =
    new AgentProcess(role, Seq(python(conf, role), "-m", s"sparksteward.agents.$role"), hello,
      conf.getInt("spark.steward.agent.max-restarts", 3))

  def newSecret(): String = { val b = new Array[Byte](32); new SecureRandom().nextBytes(b); java.util.HexFormat.of.formatHex(b) }
}

class StewardDriverPlugin extends DriverPlugin {
  private var agent: AgentProcess = _
  @volatile private var listener: StewardListener = _
  private var conf: SparkConf = _
  private var sc: SparkContext = _

  /** Picks the agent's port and secret, starts the agent in the background and returns what the
   *  executors need to reach it. */
  override def init(sc: SparkContext, ctx: PluginContext): JMap[String, String] = {
    conf = sc.getConf
    this.sc = sc
    val secret = StewardPlugin.newSecret()
    val host = conf.getOption("spark.driver.host").getOrElse(InetAddress.getLocalHost.getHostAddress)
    val bindHost = conf.getOption("spark.driver.bindAddress").getOrElse(host)
    val port = conf.getInt("spark.steward.driver.port", 0) match {
      case 0 =>
        val s = new ServerSocket()
        try { s.bind(new InetSocketAddress(bindHost, 0)); s.getLocalPort } finally s.close()
      case p => p
    }
    val hello = Messages.hello("driver", "driver", host, bindHost, port, None, None, secret,
      StewardPlugin.agentConf(conf))
    agent = StewardPlugin.agent(conf, "driver", hello)
    agent.start()
    StewardFileSystem.register("driver", agent)
    listener = new StewardListener(agent, sc)
    sc.addSparkListener(listener)
    Map("endpoint" -> s"$host:$port", "secret" -> secret).asJava
  }

  /** Runs at the end of SparkContext start: fails the start unless the agent reported `ready`. Each number
   *  of the agent's `metrics` lines becomes a gauge here, now or when it first comes (Spark registers the
   *  registry only if it has a metric now: `agent.metrics_lines` counts the lines). */
  override def registerMetrics(appId: String, ctx: PluginContext): Unit = {
    val registry = ctx.metricRegistry()
    def gauge(name: String)(value: => Any): Unit =
      try registry.register(name, new Gauge[Any] { override def getValue: Any = value })
      catch { case _: IllegalArgumentException => () } // registered already
    gauge("agent.metrics_lines")(agent.metricsLines.get())
    agent.onNewMetric = name => gauge(name)(agent.metrics.get(name))
    agent.metrics.keySet.forEach(name => gauge(name)(agent.metrics.get(name)))
    val timeoutMs = conf.getTimeAsMs("spark.steward.agent.start-timeout", "120s")
    agent.awaitAnswer(timeoutMs) match {
      case Ready(_, _) => checkStartUrls()
      case Fatal(code, message) =>
        throw new SparkException(s"spark-steward driver agent refused to start: $message [$code]")
      case Failed(message) => throw new SparkException(s"spark-steward: $message")
    }
  }

  /** SparkContext added the steward:// URLs of spark.jars/spark.files before this plugin started, unchecked
   *  (StewardFileSystem.getFileStatus): open each now, through the agent, and fail the start if one is bad. */
  private def checkStartUrls(): Unit =
    for (key <- Seq("spark.jars", "spark.files"); url <- conf.get(key, "").split(",").map(_.trim)
         if url.startsWith("steward:")) {
      val path = new org.apache.hadoop.fs.Path(url)
      try path.getFileSystem(sc.hadoopConfiguration).getFileStatus(path)
      catch { case NonFatal(e) => throw new SparkException(s"spark-steward: $url in $key cannot be read: " +
        s"${e.getMessage}. Upload it with `steward blobs put <file> --ha <the HA path of this application>` and " +
        "pass the URL it prints", e) }
    }

  /** SparkContext.stop posts app_end to the asynchronous listener bus, then shuts plugins down before
   *  it stops the bus: wait (bounded) until the listener has forwarded it, or the agent never sees it. */
  override def shutdown(): Unit = if (agent != null) {
    if (listener != null) listener.appEnded.await(10, java.util.concurrent.TimeUnit.SECONDS)
    StewardFileSystem.unregister("driver"); agent.stop()
  }
}

class StewardExecutorPlugin extends ExecutorPlugin {
  @volatile private var agent: AgentProcess = _
  // TaskContext is already unset when onTaskSucceeded/onTaskFailed run, so onTaskStart remembers it;
  // all three run on the task's thread.
  private val current = new ThreadLocal[(Long, Int, Int, Int, Int)]

  override def init(ctx: PluginContext, extraConf: JMap[String, String]): Unit = {
    // an agent started earlier for a steward:// URL in spark.jars/spark.files is this executor's agent
    agent = StewardExecutorPlugin.takeEarly().getOrElse {
      val extra = extraConf.asScala
      // ctx.hostname() fails on executors whose RpcEnv has no server address (standalone/local-cluster)
      val host = try ctx.hostname() catch { case NonFatal(_) => StewardExecutorPlugin.localHost() }
      val a = StewardExecutorPlugin.newAgent(ctx.conf(), ctx.executorID(), host, extra.get("endpoint"),
        extra.getOrElse("secret", ""))
      a.start()
      a
    }
    StewardFileSystem.register("executor", agent)
  }

  private def task(kind: String, reason: => Option[String] = None): Unit = try {
    if (kind == "task_start") {
      val tc = TaskContext.get()
      if (tc != null) current.set((tc.taskAttemptId(), tc.stageId(), tc.stageAttemptNumber(), tc.partitionId(),
        tc.attemptNumber()))
    }
    val t = current.get()
    if (kind != "task_start") current.remove()
    if (t != null && agent != null)
      agent.send(Messages.task(kind, System.currentTimeMillis(), t._1, t._2, t._3, t._4, t._5, reason))
  } catch { case NonFatal(_) => () }

  override def onTaskStart(): Unit = task("task_start")
  override def onTaskSucceeded(): Unit = task("task_succeeded")
  override def onTaskFailed(failureReason: TaskFailedReason): Unit = task("task_failed", Some(failureReason match {
    case e: ExceptionFailure => s"${e.className}: ${e.description}" // toErrorString carries the whole trace
    case other => other.toErrorString
  }))

  override def shutdown(): Unit = if (agent != null) { StewardFileSystem.unregister("executor"); agent.stop() }
}

object StewardExecutorPlugin {
  private var early: Option[AgentProcess] = None

  def localHost(): String = try InetAddress.getLocalHost.getHostName catch { case NonFatal(_) => "localhost" }

  def newAgent(conf: SparkConf, executorId: String, host: String, endpoint: Option[String],
               secret: String): AgentProcess = {
    val hello = Messages.hello("executor", executorId, host, "127.0.0.1", 0, endpoint,
      Some(Paths.get(SparkFiles.getRootDirectory()).toAbsolutePath.normalize.toString), secret,
      StewardPlugin.agentConf(conf))
    StewardPlugin.agent(conf, "executor", hello)
  }

  /** The executor's agent, started before its plugin: an executor fetches the jars and files named at
   *  start (`spark.jars`, `--jars`, ...) before Spark initializes plugins, so a steward:// URL there
   *  needs the agent sooner. The endpoint and secret come from the driver plugin's extra conf, which the
   *  executor's SparkConf carries. None on the driver, or without the driver plugin's settings. */
  def startEarly(): Option[AgentProcess] = synchronized {
    if (early.isEmpty) {
      val env = SparkEnv.get
      if (env != null && env.executorId != "driver") {
        val prefix = s"spark.plugins.internal.conf.${classOf[StewardPlugin].getName}."
        env.conf.getOption(prefix + "endpoint").foreach { endpoint =>
          val a = newAgent(env.conf, env.executorId, localHost(), Some(endpoint),
            env.conf.get(prefix + "secret", ""))
          a.start()
          StewardFileSystem.register("executor", a)
          early = Some(a)
        }
      }
    }
    early
  }

  /** The early agent, if any, handed over to the plugin (once). */
  private[shim] def takeEarly(): Option[AgentProcess] = synchronized {
    val a = early
    early = None
    a
  }
}
